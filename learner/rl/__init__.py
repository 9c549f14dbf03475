"""The RL learner service: `server` builds and runs it, `controller` drives each step, and its parts —
the ledger of outstanding work, the issuer, admission and validation, the reader, the evaluator, the
weight broadcaster, the membership of rollout servers, the stall watch, stop requests and Prometheus."""
