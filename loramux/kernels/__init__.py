"""loramux.kernels"""
