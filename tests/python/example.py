# README example: kvr.SelectionService in place of dynamo.llm.SelectionService.
import asyncio
import kvr

async def main():
    svc = kvr.SelectionService()  # Dynamo's constructor arguments; DYN_ROUTER_* env too
    await svc.upsert_worker({"worker_id": 1, "model_name": "m", "block_size": 16,
                             "endpoint": "http://gpu-host:8000",
                             "kv_events_endpoint": "tcp://gpu-host:5557"})
    r = await svc.select_and_reserve({"model_name": "m", "token_ids": list(range(64))})
    print(r["worker_id"], r["endpoint"], r["overlap"]["gpu"])  # 1 http://gpu-host:8000 0
    await svc.prefill_complete(r["selection_id"])  # first token out
    await svc.free_reservation(r["selection_id"])  # request done
    svc.shutdown()

asyncio.run(main())
