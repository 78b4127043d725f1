"""merger"""
