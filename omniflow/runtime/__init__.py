"""omniflow.runtime"""
