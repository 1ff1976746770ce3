"""baseline"""
