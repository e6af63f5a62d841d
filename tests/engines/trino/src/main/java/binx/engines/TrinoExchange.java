package binx.engines;

import io.airlift.http.client.HttpClientConfig;
import io.airlift.http.client.HttpRequestFilter;
import io.airlift.http.client.HttpVersion;
import io.airlift.http.client.Request;
import io.airlift.http.client.jetty.JettyHttpClient;
import io.airlift.slice.Slice;
import io.airlift.units.DataSize;
import io.airlift.units.Duration;
import io.trino.FeaturesConfig.DataIntegrityVerification;
import io.trino.execution.TaskId;
import io.trino.execution.buffer.CompressionCodec;
import io.trino.execution.buffer.PageDeserializer;
import io.trino.execution.buffer.PageSerializer;
import io.trino.execution.buffer.PagesSerdeFactory;
import io.trino.execution.buffer.PagesSerdes;
import io.trino.operator.HttpPageBufferClient;
import io.trino.server.InternalAuthenticationManager;
import io.trino.server.StartupStatus;
import io.trino.spi.Page;
import io.trino.spi.block.Block;
import io.trino.spi.block.BlockBuilder;

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

import static io.airlift.units.DataSize.Unit.MEGABYTE;
import static io.trino.metadata.InternalBlockEncodingSerde.TESTING_BLOCK_ENCODING_SERDE;
import static io.trino.spi.type.BigintType.BIGINT;
import static io.trino.spi.type.VarcharType.VARCHAR;
import static java.util.concurrent.TimeUnit.SECONDS;

/**
 * Trino 483's own exchange client against binxd.
 *
 * <pre>
 * make DIR PAGES          write PAGES Trino-serialized pages (Trino's page
 *                         serializer over real BIGINT and VARCHAR blocks) to
 *                         DIR/page-NNNNN.bin
 * pull LOCATION PAGES http2|http1 [SECRET]
 *                         read LOCATION (http://host:port/v1/task/T/results/B)
 *                         with HttpPageBufferClient as a Trino worker does
 *                         (checksums verified: data-integrity-verification
 *                         ABORT, Trino's default), over cleartext HTTP/2
 *                         (Trino's default since 480) or HTTP/1.1, and check
 *                         every page arrived exactly once, in order, decoding
 *                         to the rows `make` wrote; with SECRET, Trino's
 *                         InternalAuthenticationManager signs every request
 * </pre>
 *
 * With BINX_ENGINE_PAGE_ROWS=N in the environment (of both), every page
 * has N rows (small pages, thousands to a reply) instead of the mix.
 *
 * Prints one line of key=value results; exits 1 with the reason otherwise.
 */
public final class TrinoExchange
{
    private TrinoExchange() {}

    /** Rows of every page, from BINX_ENGINE_PAGE_ROWS; 0: the mix of page(i). */
    private static final int FIXED_ROWS = Integer.parseInt(System.getenv().getOrDefault("BINX_ENGINE_PAGE_ROWS", "0"));

    public static void main(String[] args)
            throws Exception
    {
        try {
            switch (args.length > 0 ? args[0] : "") {
                case "make" -> make(Path.of(args[1]), Integer.parseInt(args[2]));
                case "pull" -> pull(URI.create(args[1]), Integer.parseInt(args[2]), switch (args[3]) {
                    case "http2" -> true;
                    case "http1" -> false;
                    default -> throw new IllegalArgumentException("protocol " + args[3] + ": use http2 or http1");
                }, args.length > 4 ? Optional.of(args[4]) : Optional.empty());
                default -> throw new IllegalArgumentException("usage: make DIR PAGES | pull LOCATION PAGES http2|http1 [SECRET]");
            }
        }
        catch (Throwable t) {
            System.err.println("FAILED: " + t);
            t.printStackTrace();
            System.exit(1);
        }
        System.exit(0);
    }

    private static PagesSerdeFactory serdeFactory()
    {
        return PagesSerdes.createSpillingPagesSerdeFactory(TESTING_BLOCK_ENCODING_SERDE, CompressionCodec.NONE);
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
        BlockBuilder ids = BIGINT.createFixedSizeBlockBuilder(rows);
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
                VARCHAR.writeString(names, "trino-" + id + "-é".repeat(r % 5));
            }
        }
        return new Page(ids.buildValueBlock(), names.buildValueBlock());
    }

    static void make(Path dir, int pages)
            throws Exception
    {
        Files.createDirectories(dir);
        PageSerializer serializer = serdeFactory().createSerializer(Optional.empty());
        long bytes = 0;
        for (int i = 0; i < pages; i++) {
            Slice wire = serializer.serialize(page(i));
            Files.write(dir.resolve(String.format("page-%05d.bin", i)), wire.getBytes());
            bytes += wire.length();
        }
        System.out.println("made pages=" + pages + " bytes=" + bytes);
    }

    static void pull(URI location, int pages, boolean http2, Optional<String> secret)
            throws Exception
    {
        AtomicInteger gets = new AtomicInteger();
        AtomicInteger acks = new AtomicInteger();
        AtomicInteger deletes = new AtomicInteger();
        List<HttpRequestFilter> filters = new ArrayList<>();
        secret.ifPresent(s -> filters.add(new InternalAuthenticationManager(s, "binx-trino-test", new StartupStatus())));
        if (http2) {
            // What Trino's EnforceHttp2RequestFilter does for internal clients.
            filters.add(request -> Request.Builder.fromRequest(request).setVersion(HttpVersion.HTTP_2).build());
        }
        // Counts what the client sends (after the filters above).
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
        // As Trino configures its exchange client (ServerMainModule,
        // InternalCommunicationHttpClientModule).
        HttpClientConfig config = new HttpClientConfig()
                .setHttp2Enabled(http2)
                .setRequestTimeout(new Duration(10, SECONDS))
                .setIdleTimeout(new Duration(30, SECONDS))
                .setMaxResponseContentLength(DataSize.of(64, MEGABYTE));
        ScheduledExecutorService scheduler = Executors.newScheduledThreadPool(2);
        ExecutorService callbacks = Executors.newCachedThreadPool();
        long start = System.nanoTime();
        AtomicLong firstPageNanos = new AtomicLong();
        AtomicInteger getsBeforeFirstPage = new AtomicInteger();
        List<Slice> received = new CopyOnWriteArrayList<>();
        CompletableFuture<Void> done = new CompletableFuture<>();
        String path = location.getPath();
        String task = path.substring("/v1/task/".length(), path.indexOf("/results/"));
        try (JettyHttpClient http = new JettyHttpClient("exchange", config, filters)) {
            HttpPageBufferClient.ClientCallback callback = new HttpPageBufferClient.ClientCallback()
            {
                @Override
                public boolean addPages(HttpPageBufferClient client, List<Slice> added)
                {
                    if (!added.isEmpty() && firstPageNanos.compareAndSet(0, System.nanoTime())) {
                        getsBeforeFirstPage.set(gets.get());
                    }
                    received.addAll(added);
                    return true;
                }

                @Override
                public void requestComplete(HttpPageBufferClient client)
                {
                    if (!done.isDone()) {
                        client.scheduleRequest();
                    }
                }

                @Override
                public void clientFinished(HttpPageBufferClient client)
                {
                    done.complete(null);
                }

                @Override
                public void clientFailed(HttpPageBufferClient client, Throwable cause)
                {
                    done.completeExceptionally(cause);
                }
            };
            // 0.75 x min(exchange.max-response-size 16MB, 64MB): Trino sends "12582912B".
            HttpPageBufferClient client = new HttpPageBufferClient(
                    "binx-trino-test",
                    http,
                    DataIntegrityVerification.ABORT,
                    DataSize.ofBytes(12_582_912),
                    new Duration(30, SECONDS),
                    true,
                    TaskId.valueOf(task),
                    location,
                    callback,
                    scheduler,
                    callbacks);
            client.scheduleRequest();
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
        PageDeserializer deserializer = serdeFactory().createDeserializer(Optional.empty());
        long rows = 0;
        for (int i = 0; i < pages; i++) {
            Page got = deserializer.deserialize(received.get(i));
            assertSamePage(i, page(i), got);
            rows += got.getPositionCount();
        }
        long waitedMillis = firstPageNanos.get() == 0 ? 0 : (firstPageNanos.get() - start) / 1_000_000;
        System.out.println("ok pages=" + pages + " rows=" + rows + " gets=" + gets.get() + " acks=" + acks.get()
                + " deletes=" + deletes.get() + " gets_before_first_page=" + getsBeforeFirstPage.get()
                + " waited_ms=" + waitedMillis + " protocol=" + (http2 ? "http2" : "http1"));
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
