"""Response caches in front of the upstreams: exact (a digest of everything that shapes the answer) and
semantic (the last user message by meaning, inside an exactly-matched scope), both over one `CacheStore`."""
