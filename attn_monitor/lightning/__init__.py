"""The PyTorch Lightning adapters: the Trainer callback and Fabric's sinks."""
