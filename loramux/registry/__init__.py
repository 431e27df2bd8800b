"""loramux.registry"""
