"""updater"""
