"""loramux.resolvers"""
