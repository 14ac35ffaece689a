"""kvfleet.router"""
