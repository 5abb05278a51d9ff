"""Programs kept for the corpus are run by the tests here, never collected as tests themselves (a template's own
``tests/test_*.py`` among them needs Hydra and a dataset)."""

collect_ignore = ["lightning", "stand_ins", "third_party"]
