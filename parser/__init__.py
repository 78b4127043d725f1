"""parser"""
