"""loramux.engine"""
