"""Learner -> rollout weight transports (gloo, NCCL) and the wire layout they share."""
