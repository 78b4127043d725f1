"""netconfig"""
