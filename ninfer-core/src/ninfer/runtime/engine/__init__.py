"""The engine core: worker loop, request records, scheduler, handles, statistics, model construction."""
