"""The one place user inputs are checked and converted (validate, validate_ops), and where arrays are
recognised (arrays: CUDA arrays and DLPack exporters; dlpack: the capsule reader). A leaf: it imports
nothing of tinyknn but spec."""
