"""omniflow.models"""
