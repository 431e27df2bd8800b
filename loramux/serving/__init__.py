"""loramux.serving"""
