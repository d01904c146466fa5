"""Context parallelism: the sequence dimension split over ``parallel.cp`` ranks (context.py)."""
