"""Training and evaluation data: the embedded arithmetic task and loaders for real datasets."""
