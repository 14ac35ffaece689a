"""kvfleet.engine"""
