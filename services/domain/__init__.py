"""What every tier agrees on, in plain Python: chat templating, task definitions, scoring, pass@k."""
