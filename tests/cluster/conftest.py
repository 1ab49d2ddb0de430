from helpers.runs import tiny_corpus  # noqa: F401  (a session fixture for these tests)
