"""Repository root conftest: the plugin itself arrives through its pytest11 entry point."""
