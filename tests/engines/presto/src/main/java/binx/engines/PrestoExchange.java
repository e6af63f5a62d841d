package binx.engines;

import com.facebook.airlift.http.client.HttpClientConfig;
import com.facebook.airlift.http.client.HttpRequestFilter;
import com.facebook.airlift.http.client.Request;
import com.facebook.airlift.http.client.jetty.JettyHttpClient;
import com.facebook.airlift.http.client.spnego.KerberosConfig;
import com.facebook.airlift.units.DataSize;
import com.facebook.airlift.units.Duration;
import com.facebook.presto.common.Page;
import com.facebook.presto.common.block.Block;
import com.facebook.presto.common.block.BlockBuilder;
import com.facebook.presto.common.block.BlockEncodingManager;
import com.facebook.presto.operator.HttpRpcShuffleClient;
import com.facebook.presto.operator.PageBufferClient;
import com.facebook.presto.server.InternalAuthenticationManager;
import com.facebook.presto.spi.page.PagesSerde;
import com.facebook.presto.spi.page.PagesSerdeUtil;
import com.facebook.presto.spi.page.SerializedPage;
import io.airlift.slice.DynamicSliceOutput;
import io.airlift.slice.Slices;

import java.net.URI;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Optional;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;

import static com.facebook.airlift.units.DataSize.Unit.MEGABYTE;
import static com.facebook.presto.common.type.BigintType.BIGINT;
import static com.facebook.presto.common.type.VarcharType.VARCHAR;
import static java.util.concurrent.TimeUnit.SECONDS;

/**
 * Presto 0.296's own exchange client against binxd.
 *
 * <pre>
 * make DIR PAGES          write PAGES Presto-serialized pages (PagesSerde over
 *                         real BIGINT and VARCHAR blocks) to DIR/page-NNNNN.bin
 * pull LOCATION PAGES [SECRET]
 *                         read LOCATION (http://host:port/v1/task/T/results/B)
 *                         with PageBufferClient + HttpRpcShuffleClient, as a
 *                         Presto worker does, and check every page arrived
 *                         exactly once, in order, decoding to the rows `make`
 *                         wrote; with SECRET, Presto's InternalAuthenticationManager
 *                         signs every request
 * </pre>
 *
 * With BINX_ENGINE_PAGE_ROWS=N in the environment (of both), every page
 * has N rows (small pages, thousands to a reply) instead of the mix.
 *
 * Prints one line of key=value results; exits 1 with the reason otherwise.
 */
public final class PrestoExchange
{
    private PrestoExchange() {}

    /** Rows of every page, from BINX_ENGINE_PAGE_ROWS; 0: the mix of page(i). */
    private static final int FIXED_ROWS = Integer.parseInt(System.getenv().getOrDefault("BINX_ENGINE_PAGE_ROWS", "0"));

    public static void main(String[] args)
            throws Exception
    {
        try {
            switch (args.length > 0 ? args[0] : "") {
                case "make" -> make(Path.of(args[1]), Integer.parseInt(args[2]));
                case "pull" -> pull(URI.create(args[1]), Integer.parseInt(args[2]), args.length > 3 ? Optional.of(args[3]) : Optional.empty());
                default -> throw new IllegalArgumentException("usage: make DIR PAGES | pull LOCATION PAGES [SECRET]");
            }
        }
        catch (Throwable t) {
            System.err.println("FAILED: " + t);
            t.printStackTrace();
            System.exit(1);
        }
        System.exit(0);
    }

    private static PagesSerde serde()
    {
        return new PagesSerde(new BlockEncodingManager(), Optional.empty(), Optional.empty(), Optional.empty());
    }

    /** Page i: rows of (id BIGINT, name VARCHAR), some nulls, sizes from a few bytes to ~300 KiB. */
    static Page page(int i)
    {
        int rows = FIXED_ROWS > 0 ? FIXED_ROWS : switch (i % 4) {
            case 0 -> 1;
            case 1 -> 100;
            case 2 -> 2000;
            default -> 20_000;
        };
        BlockBuilder ids = BIGINT.createBlockBuilder(null, rows);
        BlockBuilder names = VARCHAR.createBlockBuilder(null, rows);
        for (int r = 0; r < rows; r++) {
            long id = (long) i * 1_000_000 + r;
            if (r % 7 == 3) {
                ids.appendNull();
            }
            else {
                BIGINT.writeLong(ids, id);
            }
            if (r % 11 == 5) {
                names.appendNull();
            }
            else {
                VARCHAR.writeSlice(names, Slices.utf8Slice("presto-" + id + "-é".repeat(r % 5)));
            }
        }
        return new Page(ids.build(), names.build());
    }

    static void make(Path dir, int pages)
            throws Exception
    {
        Files.createDirectories(dir);
        PagesSerde serde = serde();
        long bytes = 0;
        for (int i = 0; i < pages; i++) {
            SerializedPage serialized = serde.serialize(page(i));
            DynamicSliceOutput out = new DynamicSliceOutput(serialized.getSizeInBytes() + 64);
            PagesSerdeUtil.writeSerializedPage(out, serialized);
            byte[] wire = out.slice().getBytes();
            Files.write(dir.resolve(String.format("page-%05d.bin", i)), wire);
            bytes += wire.length;
        }
        System.out.println("made pages=" + pages + " bytes=" + bytes);
    }

    static void pull(URI location, int pages, Optional<String> secret)
            throws Exception
    {
        AtomicInteger gets = new AtomicInteger();
        AtomicInteger acks = new AtomicInteger();
        AtomicInteger deletes = new AtomicInteger();
        List<HttpRequestFilter> filters = new ArrayList<>();
        secret.ifPresent(s -> filters.add(new InternalAuthenticationManager(Optional.of(s), "binx-presto-test", true)));
        // Counts what the client sends (after the JWT filter).
        filters.add((Request request) -> {
            String path = request.getUri().getPath();
            if (request.getMethod().equals("DELETE")) {
                deletes.incrementAndGet();
            }
            else if (path.endsWith("/acknowledge")) {
                acks.incrementAndGet();
            }
            else {
                gets.incrementAndGet();
            }
            return request;
        });
        // As Presto configures its exchange client (ServerMainModule).
        HttpClientConfig config = new HttpClientConfig()
                .setRequestTimeout(new Duration(10, SECONDS))
                .setMaxContentLength(new DataSize(32, MEGABYTE));
        ScheduledExecutorService scheduler = Executors.newScheduledThreadPool(2);
        ExecutorService callbacks = Executors.newCachedThreadPool();
        long start = System.nanoTime();
        AtomicLong firstPageNanos = new AtomicLong();
        AtomicInteger getsBeforeFirstPage = new AtomicInteger();
        List<SerializedPage> received = new CopyOnWriteArrayList<>();
        CompletableFuture<Void> done = new CompletableFuture<>();
        DataSize maxResponse = new DataSize(1, MEGABYTE);
        try (JettyHttpClient http = new JettyHttpClient("exchange", config, new KerberosConfig(), filters)) {
            PageBufferClient.ClientCallback callback = new PageBufferClient.ClientCallback()
            {
                @Override
                public boolean addPages(PageBufferClient client, List<SerializedPage> added)
                {
                    if (!added.isEmpty() && firstPageNanos.compareAndSet(0, System.nanoTime())) {
                        getsBeforeFirstPage.set(gets.get());
                    }
                    received.addAll(added);
                    return true;
                }

                @Override
                public void requestComplete(PageBufferClient client)
                {
                    if (!done.isDone()) {
                        client.scheduleRequest(maxResponse);
                    }
                }

                @Override
                public void clientFinished(PageBufferClient client)
                {
                    done.complete(null);
                }

                @Override
                public void clientFailed(PageBufferClient client, Throwable cause)
                {
                    done.completeExceptionally(cause);
                }
            };
            PageBufferClient client = new PageBufferClient(
                    new HttpRpcShuffleClient(http, location),
                    new Duration(30, SECONDS),
                    true,
                    location,
                    callback,
                    scheduler,
                    callbacks);
            client.scheduleRequest(maxResponse);
            try {
                done.get(120, SECONDS);
            }
            finally {
                client.close();
            }
        }
        finally {
            scheduler.shutdownNow();
            callbacks.shutdownNow();
            callbacks.awaitTermination(5, TimeUnit.SECONDS);
        }
        if (received.size() != pages) {
            throw new AssertionError("received " + received.size() + " pages, expected " + pages);
        }
        PagesSerde serde = serde();
        long rows = 0;
        for (int i = 0; i < pages; i++) {
            Page got = serde.deserialize(received.get(i));
            assertSamePage(i, page(i), got);
            rows += got.getPositionCount();
        }
        long waitedMillis = firstPageNanos.get() == 0 ? 0 : (firstPageNanos.get() - start) / 1_000_000;
        System.out.println("ok pages=" + pages + " rows=" + rows + " gets=" + gets.get() + " acks=" + acks.get()
                + " deletes=" + deletes.get() + " gets_before_first_page=" + getsBeforeFirstPage.get()
                + " waited_ms=" + waitedMillis);
    }

    static void assertSamePage(int index, Page want, Page got)
    {
        if (want.getPositionCount() != got.getPositionCount() || want.getChannelCount() != got.getChannelCount()) {
            throw new AssertionError("page " + index + ": " + got.getPositionCount() + " rows x " + got.getChannelCount()
                    + " channels, expected " + want.getPositionCount() + " x " + want.getChannelCount());
        }
        for (int r = 0; r < want.getPositionCount(); r++) {
            Block a = want.getBlock(0);
            Block b = got.getBlock(0);
            if (a.isNull(r) != b.isNull(r) || (!a.isNull(r) && BIGINT.getLong(a, r) != BIGINT.getLong(b, r))) {
                throw new AssertionError("page " + index + " row " + r + ": id differs");
            }
            a = want.getBlock(1);
            b = got.getBlock(1);
            if (a.isNull(r) != b.isNull(r) || (!a.isNull(r) && !VARCHAR.getSlice(a, r).equals(VARCHAR.getSlice(b, r)))) {
                throw new AssertionError("page " + index + " row " + r + ": name differs");
            }
        }
    }
}
