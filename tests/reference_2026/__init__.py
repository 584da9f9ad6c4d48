"""Official update functions of the 2026 field, vendored (MIT, Apache-2.0) or transcribed, for
tests/test_presets_2026.py: each file names its upstream repository, file, commit and changes."""
