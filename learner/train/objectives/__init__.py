"""Training objectives: what a step's batch is made of and the loss on it (GRPO family, SFT)."""
