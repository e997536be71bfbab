"""Training drafters on a frozen target: one small module per drafter kind (its params and loss)."""
