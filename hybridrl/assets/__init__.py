"""Assets made locally (nothing is downloaded): tiny HF models and their tokenizer."""
