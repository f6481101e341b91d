"""The command line: python -m specdemo generate|bench|pairs."""
