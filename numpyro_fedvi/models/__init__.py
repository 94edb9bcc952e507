"""Reference models (NumPyro model/guide pairs plus closed-form references) used by examples, tests and benchmarks."""
