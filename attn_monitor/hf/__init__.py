"""The Hugging Face Trainer adapter."""
