"""Training of the shipped small model on CPU: the recipe, the corpus, the objective and the loop.

Nothing here is imported by the engine; `scripts/train_small.py` drives it.
"""
