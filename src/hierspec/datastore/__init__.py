"""Draft datastores: on-disk formats, corpus readers and builders."""
