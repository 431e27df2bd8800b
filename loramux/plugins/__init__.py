"""loramux.plugins"""
