"""Small runnable examples of the strategy (also used by the tests)."""
