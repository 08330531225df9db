"""omniflow.ir"""
