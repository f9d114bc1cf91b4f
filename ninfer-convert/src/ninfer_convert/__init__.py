"""NInfer converter: Hugging Face checkpoint folders to V3 .ninfer artifacts."""
