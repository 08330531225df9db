"""omniflow.passes"""
