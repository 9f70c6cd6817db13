"""How the packaged demo model is made: corpus, tokenizer, training loop, transformers reference.

torch and transformers are not dependencies of the project: the modules that need them import
them lazily and say what to install (see README.md here).
"""
