"""Prompt datasets, shared by the RL learner service and the offline recipes: what an example is and
the order it is read in (`examples`), the built-in and file sources (`sources`), and anything Hugging
Face `datasets` reads (`hf`)."""
