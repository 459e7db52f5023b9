"""Dialects: the same turns, attempts and streams, spoken the way existing clients speak."""
