"""The recorder service: archives every stream to Parquet and trims behind it (`rollstream-recorder`).
"""
