"""Training objectives, each owning how it builds a step's sequences and its loss: the GRPO family
(`grpo`, the RL learner's), supervised fine-tuning (`sft`) and preference optimisation (`dpo`)."""
