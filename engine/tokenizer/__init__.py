"""Text ↔ token ids: the Hugging Face tokenizer, a GGUF file's tokenizer metadata, the byte-level twin, the detokenizer.

Where it sits: the API process encodes prompts and renders chats with these (torch-free), the engine core
detokenizes each step's tokens with :mod:`kvfleet.engine.tokenizer.detokenizer`.
"""
