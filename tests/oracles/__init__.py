"""Test-only reference implementations, written independently of the code they check."""
