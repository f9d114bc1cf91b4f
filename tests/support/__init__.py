"""Plain helpers shared by several test packages (imported as ``support.<module>``: tests/ is on sys.path
through the root conftest). Fixtures over them live in tests/conftest.py."""
