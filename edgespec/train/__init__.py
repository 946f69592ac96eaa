"""Training of feature heads (EAGLE-3) by self-distillation: corpus → target features and soft labels
cached on disk (``data``, ``features``) → a torch head with training-time test (``model``,
``trainer``) → a llama.cpp-layout GGUF. Needs the ``train`` extra (torch) only for ``model`` and
``trainer``."""
