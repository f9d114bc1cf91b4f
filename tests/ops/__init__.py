"""Op qualification suites (a package so module names cannot collide with other test folders)."""
