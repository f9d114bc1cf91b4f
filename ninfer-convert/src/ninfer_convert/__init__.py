"""The ``ninfer-convert`` command: Hugging Face checkpoint folders to V3 .ninfer artifacts, and ``verify``.

The conversion itself is core's :mod:`ninfer.conversion`; this distribution is its command line.
"""
