"""Where models come from: Hugging Face transformers (``hf``), GGUF files (``gguf``), their
tokenizers (``tokenizer``) and the models kvsimd knows how to fetch (``registry``)."""
