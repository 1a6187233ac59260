"""Small pieces every layer may use: layer-name patterns, argument checks, warn-once,
layer names without wrappers. Standard library and ``torch.nn`` only."""
