"""Scripts that humans and CI share (the Python ones; the others are shell)."""
