"""kvfleet.operator"""
