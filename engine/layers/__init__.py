"""The model's layers by what they compute, apart from the model that arranges them.

Where it sits: ``engine/model/llama.py`` builds the decoder and asks ``layers/linear`` how each of
its matmuls is loaded, laid out, run and handed to the one-call native decode, whatever format its
weights are in.
"""
